"""How gradients travel: the bucketed reducer, the codecs (fp16, bf16), ZeRO sharding over Horovod."""
