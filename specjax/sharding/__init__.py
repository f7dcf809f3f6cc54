"""Sharding on a device mesh (JAX's own ``Mesh`` / ``NamedSharding`` / ``jax.jit`` shardings /
``jax.distributed``).

    import specjax.sharding as shd

    mesh = shd.make_mesh("cpu-8")                        # or "data=2,tensor=4", a YAML file, None
    lt = shd.load_target("path/to/hf", mesh)             # params straight into their shardings
    draft = shd.load_draft("draft_dir", lt, mesh)
    shd.shard_params(module, shd.TARGET_RULES, mesh)     # place an already loaded module
    specs = shd.partition_specs(state, shd.DRAFT_RULES, mesh)   # checked: every leaf, every dim
    cache_sh = shd.kv_cache_sharding(mesh, cache)        # batch on (data, fsdp), heads on tensor

See docs/sharding.md.
"""

from specjax.sharding.apply import (  # noqa: F401
    BATCH, abstract_with_shardings, batch_sharding, batch_shardings, batch_spec, constrain_cache, kv_cache_sharding,
    mesh_of, pad_batch, put, put_local_batch, replicated, shard_params, sharded_jit, shardings_of,
)
from specjax.processes import to_host  # noqa: F401
from specjax.sharding.distributed import (  # noqa: F401
    initialize, is_main_process, main_print, process_count, process_index, shutdown, sync,
)
from specjax.sharding.errors import (  # noqa: F401
    DistributedConfigError, IndivisibleShardError, MeshConfigError, PartitionRuleError, ShardingError,
    UnmatchedParamError,
)
from specjax.sharding.load import (  # noqa: F401
    check_target, load_draft, load_target, restore_orbax, sharding_fn, slice_loader,
)
from specjax.sharding.mesh import (  # noqa: F401
    AXES, BATCH_AXES, MeshConfig, batch_divisor, describe, load_mesh_config, make_mesh, presets,
)
from specjax.sharding.rules import (  # noqa: F401
    DRAFT_RULES, OPTIMIZER_RULES, TARGET_RULES, PartitionRules, Rule, explain, named_shardings, optimizer_rules,
    partition_specs, path_str, spec_for,
)
