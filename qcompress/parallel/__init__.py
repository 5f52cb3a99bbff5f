"""Tensor parallelism composed with compression, on PyTorch's engines (DeviceMesh, DTensor
parallelize_module); the engine builds the mesh and calls these (engine/engine.py)."""

from .mesh import ParallelMesh, build_mesh
from .tensor_parallel import apply_tensor_parallel, resolve_plan

__all__ = ["ParallelMesh", "build_mesh", "apply_tensor_parallel", "resolve_plan"]
