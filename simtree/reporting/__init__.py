"""Reports: the plan report (:mod:`.plan_report`: plan.md, heat map and throughput figures,
and :func:`~simtree.reporting.plan_report.plan_and_write`, what `simtree plan` calls) and the
closed-loop report of a machine's profile -> fit -> plan -> run, predicted against measured
(:mod:`.loop`).  Nothing is re-exported: these modules import pandas and, to draw, matplotlib.
"""
