"""Running gcache on real hosts: the TOML config file, health endpoints, supervision."""
