"""One writer of the speculators config.json (bridge.config_doc): a training export and a
third-party conversion of the same algorithm write documents with the same keys, and the same
values where they describe the same draft."""

from __future__ import annotations

import pytest

from bridge.external.convert import plan_external
from specjax.train.export import speculators_config
from tests.bridge.external import sources

SOURCES = {"eagle3": ("eagle3-safeailab", "llama", sources.safeailab_eagle3,
                      {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}),
           "dflash": ("dflash-zlab", "qwen3", sources.zlab_dflash, {}),
           "mtp": ("mtp", "qwen3", sources.native_mtp, {})}
# what differs by design: the converter stamps its version, names the legacy class / source dtype
BY_DESIGN = {"speculators_version", "architectures", "dtype"}


def keys(doc, prefix=""):
    out = set()
    for k, v in doc.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k != "transformer_layer_config":
            out |= keys(v, prefix + k + ".")
    return out


@pytest.mark.parametrize("algo", sorted(SOURCES))
def test_training_and_converter_docs_have_the_same_keys(algo, tmp_path, verifiers):
    kind, fam, build, opts = SOURCES[algo]
    v = verifiers[fam]
    _, _, plan = plan_external(build(tmp_path / "src", v), kind, v, **opts)
    conv = plan.config
    fields = {k: conv[k] for k in ("block_size", "mask_token_id", "sample_from_anchor", "sliding_window_non_causal",
                                   "embed_requires_grad", "fc_norm", "norm_before_fc", "norm_before_residual",
                                   "norm_output") if k in conv}
    aux = conv.get("eagle_aux_hidden_state_layer_ids", conv.get("aux_hidden_state_layer_ids"))
    pm = conv["speculators_config"]["proposal_methods"][0]
    ver = conv["speculators_config"]["verifier"]
    train = speculators_config(algo, layer=conv["transformer_layer_config"],
                               draft_vocab_size=conv.get("draft_vocab_size", 0), aux_layer_ids=aux,
                               speculative_tokens=pm["speculative_tokens"], verifier=ver["name_or_path"],
                               verifier_arch=ver["architectures"][0], **fields)
    assert keys(train) == keys(conv)
    assert list(train) == list(conv) == sorted(conv)  # one key order: the file's
    differ = {k for k in conv if conv[k] != train[k]}
    assert differ <= BY_DESIGN, {k: (conv[k], train[k]) for k in differ - BY_DESIGN}
