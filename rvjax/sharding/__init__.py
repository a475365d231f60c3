"""Shardings for tensor parallelism over a ("data", "model") mesh: rvjax/sharding/rules.py."""

from rvjax.sharding.rules import (DATA, LOGICAL_TO_MESH, MODEL, cache_shardings, laid_out, param_shardings,
                                  partition_spec, stack)

__all__ = ["DATA", "LOGICAL_TO_MESH", "MODEL", "cache_shardings", "laid_out", "param_shardings", "partition_spec",
           "stack"]
