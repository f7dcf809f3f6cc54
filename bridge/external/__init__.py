"""Third-party drafts into the speculators format (speculators 0.9.0 ``convert/``).

    from bridge import convert_external
    res = convert_external("EAGLE3-LLaMA3.1-Instruct-8B", "eagle3-safeailab", "Llama-3.1-8B-Instruct",
                           "out", norm_before_residual=False)
    res = convert_external("Qwen3-8B-DFlash-b16", "auto", "Qwen3-8B", "out")   # res.detected says why

Source kinds: ``eagle3-safeailab`` (``midlayer.*``), ``dflash-zlab`` (``dflash_config``),
``mtp`` (``mtp.*`` heads inside a verifier checkpoint), ``auto``; speculators' own names
``eagle3`` / ``dflash`` are accepted too. Pure numpy + safetensors (``pytorch_model.bin``
read without torch). The output is audited before it is published;
``specjax convert SRC DST --from KIND --verifier DIR`` is the same call.

What is written equals speculators 0.9.0's ``convert_model`` on the same input: tensor
names, dtypes and bytes, and every config value apart from ``speculators_version``
(``"0.9.0+specjax"``; ``transformers_version`` is the transformers 5.19 serialisation this
reproduces, see :mod:`bridge.external.hf_config`). Where speculators writes a broken or
misleading checkpoint, specjax differs on purpose:

* a tensor the draft needs is missing from the source, or mis-shaped: speculators' EAGLE-3
  path loads ``strict=False`` and saves its random init; specjax refuses, naming the tensor;
* native MTP: speculators also writes ``verifier_lm_head.weight`` filled with its NaN
  sentinel (it never loads verifier weights; ``MTPDraftModel`` deletes the tensor on load);
  specjax leaves it out (it would fail the audit);
* EAGLE-3 with ``norm_before_fc`` / ``fc_norm``: speculators' legacy converter module has no
  ``input_norm`` / ``fc_norm`` parameters and drops them; specjax keeps them from the
  source and refuses when the flag is set but the source lacks them;
* a pruned EAGLE-3 (``draft_vocab_size`` < vocab) without ``t2d``: speculators writes a
  draft without a vocabulary mapping; specjax refuses;
* the verifier must be a local directory (speculators also downloads hub ids), and
  ``num_hidden_layers`` of a multimodal verifier is also looked up in ``text_config``
  (speculators' DFlash path raises KeyError there); sharded sources are read for EAGLE-3 and
  DFlash too (speculators refuses them).
"""

from bridge.external.convert import (  # noqa: F401
    ALIASES, SOURCES, ExternalConversion, convert_external, detect_source, plan_external,
)
from bridge.external.errors import (  # noqa: F401
    ExternalAuditError, ExternalSourceError, UnrecognizedSourceError, VerifierError,
)
