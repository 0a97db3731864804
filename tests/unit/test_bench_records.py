"""Benchmark records survive horovodrun's output mangling."""

from hvdtrain.bench.launching import records


def test_records_are_found_in_tagged_and_glued_launcher_output():
    out = (
        "[1,0]<stdout>:{\"bench\": \"allreduce\", \"mode\": \"fp32\"}\n"
        "[0]<stderr>:warning: something\n"
        # Open MPI glued the next record, tag included, onto the end of a line.
        "[1,0]<stdout>:{\"bench\": \"allreduce\", \"mode\": \"fp16\"}[1,0]<stdout>:{\"bench\": \"goodput\", \"x\": 1}\n"
        "{\"bench\": \"allreduce\", \"mode\": \"bf16\"}\n"
    )
    assert [r["mode"] for r in records(out, "allreduce")] == ["fp32", "fp16", "bf16"]
    assert [r["bench"] for r in records(out)] == ["allreduce", "allreduce", "goodput", "allreduce"]
    assert records("no records here\n") == []
