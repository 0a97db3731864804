"""Built-in tasks for the CLI and the benchmarks: data generated or found locally, a model, a loss.
The training loop never imports this package; it takes any model, dataset and loss."""

from hvdtrain.tasks.builtin import BUILDERS, LossFn, Task, build_task, check_inputs, classification_loss, lm_loss

__all__ = ["BUILDERS", "LossFn", "Task", "build_task", "check_inputs", "classification_loss", "lm_loss"]
