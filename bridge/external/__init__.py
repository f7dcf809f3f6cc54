"""Third-party drafts into the speculators format (speculators 0.9.0 ``convert/``).

    from bridge import convert_external
    res = convert_external("EAGLE3-LLaMA3.1-Instruct-8B", "eagle3-safeailab", "Llama-3.1-8B-Instruct",
                           "out", norm_before_residual=False)
    res = convert_external("Qwen3-8B-DFlash-b16", "auto", "Qwen3-8B", "out")   # res.detected says why

Source kinds: ``eagle3-safeailab`` (``midlayer.*``), ``dflash-zlab`` (``dflash_config``),
``mtp`` (``mtp.*`` heads inside a verifier checkpoint), ``auto``. Pure numpy +
safetensors (``pytorch_model.bin`` read without torch). The output is audited before it
is published; ``specjax convert SRC DST --from KIND --verifier DIR`` is the same call.
"""

from bridge.external.convert import (  # noqa: F401
    ALIASES, SOURCES, ExternalConversion, convert_external, detect_source, plan_external,
)
from bridge.external.errors import (  # noqa: F401
    ExternalAuditError, ExternalSourceError, UnrecognizedSourceError, VerifierError,
)
