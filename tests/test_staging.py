"""The staging pool that carries device tensors over host transports, tested with CPU tensors."""

import pytest

torch = pytest.importorskip("torch", reason="the staging pool needs the torch extra")

from gcache import Client, Status
from gcache.client.staging import StagingConfig, StagingPool, TorchCopier
from gcache.errors import ConfigError

KB = 1024


class RecordingCopier(TorchCopier):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def to_host(self, src, host):
        self.log.append(("to_host", int(src[0].item())))
        super().to_host(src, host)

    def to_device(self, host, dst):
        super().to_device(host, dst)
        self.log.append(("to_device", int(dst[0].item())))

    def synchronize(self):
        self.log.append(("sync",))


class RecordingClient:
    def __init__(self, client, log):
        self.client, self.log = client, log

    def put(self, keys, values, **kw):
        self.log.append(("put", tuple(keys)))
        return self.client.put(keys, values, **kw)

    def get_into(self, keys, bufs, **kw):
        self.log.append(("get", tuple(keys)))
        return self.client.get_into(keys, bufs, **kw)


def tensors(n, size):
    # element 0 of tensor i is i, so copies can be traced; the rest is a pattern
    out = []
    for i in range(n):
        t = (torch.arange(size, dtype=torch.int32) * 7 + i) % 251
        t[0] = i
        out.append(t)
    return out


def test_chunks_follow_key_order_and_fit_a_buffer():
    pool = StagingPool(StagingConfig(buffers=2, buffer_bytes=10 * KB))
    assert pool.chunks([4 * KB, 4 * KB, 4 * KB, 10 * KB, 1]) == [[0, 1], [2], [3], [4]]
    with pytest.raises(ValueError, match="larger than a staging buffer"):
        pool.chunks([11 * KB])
    with pytest.raises(ConfigError):
        StagingConfig(buffers=1)


def test_put_and_get_through_many_chunks_byte_exact(cluster):
    pool = StagingPool(StagingConfig(buffers=3, buffer_bytes=64 * KB))
    src = tensors(40, 3000)  # 12 KB each: 5 per chunk, 8 chunks
    keys = [f"t{i}" for i in range(len(src))]
    with Client(cluster.addresses) as client:
        assert pool.put(client, keys, src) == [Status.OK] * len(keys)
        dst = [torch.zeros_like(t) for t in src]
        assert pool.get_into(client, keys, dst) == [Status.OK] * len(keys)
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        assert pool.chunks_moved == 16
        short = [torch.zeros(10, dtype=torch.int32)]
        assert pool.get_into(client, keys[:1], short) == [Status.BUFFER_TOO_SMALL]
        assert pool.get_into(client, ["absent"], [torch.zeros(4)]) == [Status.NOT_FOUND]


def test_device_copies_overlap_the_network_in_order(cluster):
    log = []
    pool = StagingPool(StagingConfig(buffers=2, buffer_bytes=8 * KB), RecordingCopier(log))
    src = tensors(6, 1024)  # 4 KB each: 2 per chunk, 3 chunks
    keys = [f"o{i}" for i in range(6)]
    with Client(cluster.addresses) as client:
        rc = RecordingClient(client, log)
        pool.put(rc, keys, src)
        puts = [i for i, e in enumerate(log) if e[0] == "put"]
        fills = [i for i, e in enumerate(log) if e[0] == "to_host"]
        assert [log[i][1] for i in puts] == [("o0", "o1"), ("o2", "o3"), ("o4", "o5")]
        assert [log[i][1] for i in fills] == list(range(6))  # every key staged once, in order
        # chunk c+1 is copied to the host before chunk c goes to the network
        assert fills[2] < puts[0] and fills[4] < puts[1]
        log.clear()
        dst = [torch.zeros_like(t) for t in src]
        pool.get_into(rc, keys, dst)
        gets = [i for i, e in enumerate(log) if e[0] == "get"]
        devs = [i for i, e in enumerate(log) if e[0] == "to_device"]
        assert [log[i][1] for i in devs] == list(range(6))
        assert gets[0] < devs[0] < gets[1] < devs[2] < gets[2] < devs[4]
        # with 2 buffers, chunk 2 reuses chunk 0's buffer: a sync must come before its get
        assert any(e == ("sync",) for e in log[devs[1]:gets[2]])
        assert all(torch.equal(a, b) for a, b in zip(src, dst))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `gcache bench gpu-check` on a GPU host)")
def test_cuda_tensors_go_through_pinned_staging(cluster):
    src = [torch.arange(1 << 18, dtype=torch.float32, device="cuda") + i for i in range(8)]
    keys = [f"g{i}" for i in range(8)]
    with Client(cluster.addresses) as client:
        assert client.put(keys, src) == [Status.OK] * 8
        dst = [torch.empty_like(t) for t in src]
        assert client.get_into(keys, dst).hits == 8
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
