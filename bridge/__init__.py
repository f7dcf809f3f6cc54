"""specjax bridge: speculators checkpoints <-> Flax param trees and Orbax, plus the audit.

Format layer only (json, safetensors, numpy); no Flax modules. Public API:
  load_checkpoint(path) -> Checkpoint      save_checkpoint(out, config, tree, ...)
  save_orbax / restore_orbax               audit(path, verifier=None, deep=False) -> Report
  read_config / parse_config               open_tensors(dir)
"""

from bridge.errors import (  # noqa: F401
    BridgeError, CheckpointNotFoundError, ConfigError, OrbaxFormatError, SafetensorsFormatError, ShardIndexError,
    TensorMismatchError, UnknownModelTypeError, WriteError,
)
from bridge.schema import (  # noqa: F401
    ALGORITHMS, DFlashConfig, DraftConfig, DSparkConfig, Eagle3Config, LayerConfig, MTPConfig, PEagleConfig,
    parse_config, read_config,
)
from bridge.safetensors_io import open_tensors  # noqa: F401
from bridge.checkpoint import Checkpoint, Opened, load_checkpoint, open_checkpoint, save_checkpoint  # noqa: F401
from bridge.orbax_io import restore_orbax, save_orbax  # noqa: F401
from bridge.auditor import Finding, Report, VerifierFacts, audit  # noqa: F401
from bridge.summary import summarize  # noqa: F401
from bridge.external import convert_external  # noqa: F401,E402
