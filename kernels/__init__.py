"""Triton kernels, each beside its torch reference (strata.kernels.reference is the tests' oracle).

Import from the submodules, e.g. `from strata.kernels.paged_attention import paged_attention` and
`from strata.kernels.kv_cache_write import write_kv_cache`. Nothing is re-exported here on purpose:
the function `paged_attention` would shadow its module of the same name, and importing this
package must not define any kernel, because triton.jit reads TRITON_INTERPRET at definition.
"""
