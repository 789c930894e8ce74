"""Tools around a run: they read or use what a run wrote. Held-out evaluation (`evaluate`, also called by
the loop), generate/chat/export (`inference`), the trace audit and its report (`audit`, `report`), and replay
and rescore of traced completions (`replay`).
"""
