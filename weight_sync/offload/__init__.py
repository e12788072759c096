"""Distributed layerwise offload (DLO): plan, host storage, streamer, runtime-weight cache."""
