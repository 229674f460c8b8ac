"""ShapesBench: the MARBLE paper's Table 1 / Table S1 / Table 2 at CPU scale (see docs/shapesbench.md).

    python benchmarks/shapesbench.py pretrain          # build and cache the base model (~8 min on 2 cores)
    python benchmarks/shapesbench.py run               # all methods x 3 seeds, tables and plots in outputs/shapesbench
    python benchmarks/shapesbench.py report            # rewrite the tables and plots from the run records

Same as ``python -m marble_trl.shapesbench ...``.
"""

from marble_trl.shapesbench.__main__ import main

if __name__ == "__main__":
    main()
