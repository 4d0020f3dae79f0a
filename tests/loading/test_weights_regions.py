"""Which part of each tensor a host reads when the mesh spans processes (`jaxllm.loading.weights`)."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.loading.fused import fuse
from jaxllm.loading.weights import _window, local_region


def test_local_region_of_one_process_is_everything():
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("tp",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "tp"))
    assert local_region((3, 8, 5), sharding) == (slice(0, 3), slice(0, 8), slice(0, 5))


def test_window_takes_the_same_share_of_each_fused_part():
    region = (slice(48, 96), slice(0, 64))  # the second half of a [96, 64] fused qkv (4 KV heads x (2 + 2) x 6)
    assert _window(region, (96, 64), (48, 64)) == (slice(24, 48), slice(0, 64))  # q: [8 heads x 6, 64]
    assert _window(region, (96, 64), (24, 64)) == (slice(12, 24), slice(0, 64))  # k and v: [4 x 6, 64]
    assert _window((slice(0, 96), slice(0, 64)), (96, 64), (48, 64)) is None  # all of it: read whole


def test_fusing_each_hosts_share_gives_that_hosts_rows_of_the_full_fusion():
    class Cfg:
        num_kv_heads, head_dim = 4, 6

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((48, 5)), rng.standard_normal((24, 5)), rng.standard_normal((24, 5))
    full = fuse("qkv_proj", [q, k, v], Cfg)
    halves = [fuse("qkv_proj", [q[h * 24:(h + 1) * 24], k[h * 12:(h + 1) * 12], v[h * 12:(h + 1) * 12]], Cfg)
              for h in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), full)
    gate, up = rng.standard_normal((16, 5)), rng.standard_normal((16, 5))
    full = fuse("gate_up_proj", [gate, up], Cfg)
    np.testing.assert_array_equal(fuse("gate_up_proj", [gate[8:], up[8:]], Cfg), full[16:])
