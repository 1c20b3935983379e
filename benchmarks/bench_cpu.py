"""CPU benchmark: the tiled engine against SDPA and naive attention (same as `causalattn bench`).

python benchmarks/bench_cpu.py [--quick] [--json]
"""

import json
import sys

from causalattn.bench import cpu

if __name__ == "__main__":
    rows = cpu.run(quick="--quick" in sys.argv)
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=2))
    else:
        cpu.render(rows)
