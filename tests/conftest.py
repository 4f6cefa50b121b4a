"""Shared fixtures: the benchmark models in ../shared/models (skipped cleanly when absent)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))  # tests/fuzzgraphs.py, importable by name

# Hypothesis profiles: "fast" (default: seeded, a few fuzz graphs, reproducible in CI) and "long"
# (`pytest -m fuzz --hypothesis-profile=long`: thousands of graphs). Tests that set their own
# max_examples keep them.
settings.register_profile("fast", max_examples=6, derandomize=True, deadline=None)
settings.register_profile("long", max_examples=3000, deadline=None)
settings.load_profile("fast")

SHARED_MODELS = Path(__file__).parents[2] / "shared" / "models"
SHARED_NAMES = ("candy", "gpt2_mini", "segformer_b0", "yolox_tiny")


@pytest.fixture(scope="session")
def shared_models() -> Path:
    """The directory of benchmark .onnx files; the test is skipped when it is not there."""
    if not SHARED_MODELS.is_dir() or not any(SHARED_MODELS.glob("*.onnx")):
        pytest.skip(f"shared models not found at {SHARED_MODELS}")
    return SHARED_MODELS


@pytest.fixture
def shared_model(shared_models, request) -> Path:
    """One benchmark model by name (parametrize indirectly); skipped when that file is absent."""
    p = shared_models / f"{request.param}.onnx"
    if not p.exists():
        pytest.skip(f"{p} not found")
    return p


@pytest.fixture
def benchmark_script():
    """A script of benchmarks/ loaded as a module, by its stem (the scripts are not a package)."""
    import importlib.util

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (a dataclass of the script looks its module up there)
        spec.loader.exec_module(module)
        return module
    return load
