"""Errors for bad model directories and checkpoints.

Each names what was wrong and what was expected. They subclass ValueError (FileNotFoundError for a missing
path) so callers that only care about "bad input" can catch one type.
"""


class CheckpointError(ValueError):
    """A model directory or checkpoint that this engine cannot load."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The model directory, config.json or a weight file does not exist."""


class UnknownModelTypeError(CheckpointError):
    """config.json names a model_type this engine does not run."""


class InconsistentLayersError(CheckpointError):
    """The KDA / full-attention layer lists do not cover every layer exactly once."""


class MissingTensorError(CheckpointError):
    """A parameter the model needs is not in the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds a tensor the model has no place for."""


class TensorShapeError(CheckpointError):
    """A checkpoint tensor's shape differs from the parameter's."""
