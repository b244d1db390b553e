"""The communication substrate and its cost model: when does low-bit pay on a given fabric?

- `model`: `Substrate` (link, latency, reducer topology, endpoint capacity, codec throughput),
  TOML load/save.
- `cost`: the α-β cost model per collective, per route and per DDP bucket; verdicts and
  crossovers. The binding layer and the runtime's capacity gate call `bucket_verdict`.
- `project`: cluster-scale projection (world sizes x link speeds) from parameter shapes.

This package sits just above `routes/`: it never imports profile, binding or runtime code.
"""

from nfabric_cli.substrate.model import Substrate, load_substrate, save_substrate

__all__ = ["Substrate", "load_substrate", "save_substrate"]
