"""gcache.sizes: the one parser of byte sizes and token counts, its edge cases and errors."""

import pytest

from gcache.errors import ConfigError
from gcache.sizes import format_size, parse_size, parse_tokens


@pytest.mark.parametrize("text, n", [
    ("4096", 4096), ("0", 0), ("7B", 7), ("64KiB", 65536), ("64kib", 65536), (" 64 KiB ", 65536),
    ("512MiB", 512 << 20), ("4GiB", 4 << 30), ("2TiB", 2 << 40),
    ("64K", 64_000), ("64kb", 64_000), ("1.5GB", 1_500_000_000), ("3M", 3_000_000), ("1t", 10**12),
    ("1.5MiB", 3 << 19), (".5KiB", 512), ("0.3KiB", 307),  # fractions round down to whole bytes
    (123, 123), (0, 0),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", [
    "", " ", "lots", "KiB", "-1", "-1KiB", "1e3", "1,000", "5.", "1.2.3", "64 KiBB", "64XB", "inf", "nan",
    -1, True, False, 1.5, None, [64], b"64",
])
def test_parse_size_refuses_with_a_config_error_quoting_the_input(bad):
    with pytest.raises(ConfigError, match="cannot read size") as e:
        parse_size(bad)
    assert repr(bad) in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("text, n", [
    ("0", 0), ("100", 100), ("64K", 65536), ("64k", 65536), ("256K", 262144), ("1M", 1 << 20),
    ("1.5K", 1536), (" 2 M ", 2 << 20), (131072, 131072),
])
def test_parse_tokens_counts_k_as_1024(text, n):
    assert parse_tokens(text) == n


@pytest.mark.parametrize("bad", ["64Q", "64KiB", "64KB", "1G", "-5", "", True, -3, 2.0])
def test_parse_tokens_refuses(bad):
    with pytest.raises(ConfigError, match="cannot read token count"):
        parse_tokens(bad)


def test_router_buckets_and_config_checks_use_it():
    from gcache.ops.config import Kind, _type_error
    from router.config import BucketConfig

    assert BucketConfig.parse("0-64K,64K-256K,256K-1M").ranges == ((0, 65536), (65536, 262144), (262144, 1 << 20))
    with pytest.raises(ValueError, match="bad bucket bound: cannot read token count '64Q'"):
        BucketConfig.parse("0-64Q")
    assert _type_error(Kind.SIZE, "64MiB") is None and _type_error(Kind.SIZE, 64) is None
    for bad in ("lots", True, -1, 1.5, ["1GiB"]):
        assert _type_error(Kind.SIZE, bad) == f"expected {Kind.SIZE.value}, got {bad!r}"


@pytest.mark.parametrize("n, text", [(0, "0B"), (1023, "1023B"), (1024, "1.0KiB"), (3 << 19, "1.5MiB"),
                                     (5 << 40, "5.0TiB"), (1 << 50, "1024.0TiB")])
def test_format_size(n, text):
    assert format_size(n) == text
