"""Diffusion step caching at the GEN-stack boundary: SeaCache and the no-cache baseline."""
