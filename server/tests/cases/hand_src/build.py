import lib, part1, part2, part3, part4, part5
import os; lib.dump(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hand.jsonl"))
