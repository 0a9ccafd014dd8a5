"""The peer comparison: `python -m bench.peers.compare` (setup once: bench/peers/setup.sh)."""
