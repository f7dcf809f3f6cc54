"""Project-wide pytest setup: CPU JAX, quiet logs, and session-built speculators fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests import speedups  # noqa: E402

speedups.apply()


def pytest_configure(config):
    try:
        from loguru import logger

        logger.remove()  # speculators logs every verifier-weight lookup at INFO
    except ImportError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the file's fixtures are finalised first
    if nextitem is None or nextitem.path != item.path:
        speedups.release_caches()


# The longest test files (each 1-3.5 min on the 2-core CI machine), run first: the two xdist workers
# (--dist loadfile) take files in collection order, so the short files fill in at the end instead of
# one worker finishing a long file alone while the other idles.
SLOW_FIRST = (
    "tests/notebooks/test_03_train_eagle3_draft.py",
    "tests/notebooks/test_02_speculative_decoding.py",
    "tests/sharding/test_spec_mesh.py",
    "tests/decode/test_tree_smollm2.py",
    "tests/train/test_smollm2_e2e.py",
    "tests/test_plan.py",
    "tests/decode/test_tree_loop.py",
    "tests/sharding/test_mesh8.py",
    "tests/notebooks/test_01_convert_and_audit.py",
    "tests/models/test_smollm2.py",
)
_ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    rank = {p: i for i, p in enumerate(SLOW_FIRST)}

    def key(item):
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(_ROOT).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def spec_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spec")


@pytest.fixture(scope="session")
def verifiers(spec_root):
    from tests.refs.speculators_ckpts import make_verifier

    return {fam: make_verifier(spec_root / f"verifier-{fam}", fam) for fam in ("llama", "qwen3")}


@pytest.fixture
def umask022():
    """The process umask set to the usual 0o022 for one test (restored after it)."""
    old = os.umask(0o022)
    yield 0o022
    os.umask(old)


def unreadable_modes(root: Path) -> list[str]:
    """``root`` and everything under it whose mode is not a directory's 0755 or a file's 0644
    (what umask 0o022 gives), as ``'0700 path'`` lines; empty when all are ordinary."""
    import stat

    bad = []
    for p in [Path(root), *sorted(Path(root).rglob("*"))]:
        want = 0o755 if p.is_dir() else 0o644
        got = stat.S_IMODE(p.lstat().st_mode)
        if got != want:
            bad.append(f"{got:04o} {p} (expected {want:04o})")
    return bad
