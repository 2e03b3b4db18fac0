"""Writes every hand-worked case (the topic modules beside this file) to ../hand.jsonl."""
import lib, fast_path_edges, wake_affine, select_idle_sibling, slow_path_and_capacity, can_migrate  # noqa: F401 (each adds its cases)
import os; lib.dump(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hand.jsonl"))
