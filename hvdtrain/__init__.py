"""hvdtrain: data-parallel PyTorch training on Horovod.

    world = hvdtrain.World.init()
    result = hvdtrain.fit(world, model, optimizer, train_set, hvdtrain.Config(...), eval_set=...)
"""

from hvdtrain.activations import checkpoint_modules
from hvdtrain.config import (
    CheckpointConfig,
    CommConfig,
    Config,
    DataConfig,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from hvdtrain.errors import HvdtrainError
from hvdtrain.loop import FitResult, evaluate, fit
from hvdtrain.world import World

__version__ = "0.1.0"
__all__ = [
    "CheckpointConfig", "CommConfig", "Config", "DataConfig", "FitResult", "HvdtrainError", "LogConfig", "MemoryConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "World", "checkpoint_modules", "evaluate", "fit",
]
