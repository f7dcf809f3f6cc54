"""Project-wide pytest setup: CPU JAX, quiet logs, and session-built speculators fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
    try:
        from loguru import logger

        logger.remove()  # speculators logs every verifier-weight lookup at INFO
    except ImportError:
        pass


@pytest.fixture(scope="session")
def spec_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spec")


@pytest.fixture(scope="session")
def verifiers(spec_root):
    from tests.refs.speculators_ckpts import make_verifier

    return {fam: make_verifier(spec_root / f"verifier-{fam}", fam) for fam in ("llama", "qwen3")}
