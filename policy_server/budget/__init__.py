"""Latency-budget control (pure Python): cost model, quality profile, per-tick planner, in-tick deadline guard."""
