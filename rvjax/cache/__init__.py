from rvjax.cache.kv import KVCache, LayerKV, KV_DTYPES, kv_bytes_per_token, new_cache

__all__ = ["KVCache", "LayerKV", "KV_DTYPES", "kv_bytes_per_token", "new_cache"]
