# Stand-in for sgl_kernel.kvcacheio: mem_cache/memory_pool_host.py:47 imports it; only HiCache calls it.


def _unavailable(*args, **kwargs):
    raise NotImplementedError("sgl_kernel.kvcacheio is not available on CPU (stand-in)")


transfer_kv_all_layer = _unavailable
transfer_kv_all_layer_direct_lf_pf = _unavailable
transfer_kv_all_layer_lf_pf = _unavailable
transfer_kv_all_layer_lf_ph = _unavailable
transfer_kv_all_layer_mla = _unavailable
transfer_kv_all_layer_mla_lf_pf = _unavailable
transfer_kv_direct = _unavailable
transfer_kv_per_layer = _unavailable
transfer_kv_per_layer_direct_pf_lf = _unavailable
transfer_kv_per_layer_mla = _unavailable
transfer_kv_per_layer_mla_pf_lf = _unavailable
transfer_kv_per_layer_pf_lf = _unavailable
transfer_kv_per_layer_ph_lf = _unavailable
