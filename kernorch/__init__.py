"""kernorch: optimal kernel orchestration for ONNX models."""
from .ir import KernorchError

__version__ = "0.1.0"
__all__ = ["KernorchError", "__version__"]
