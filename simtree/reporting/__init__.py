"""Reports, rendered from what planning and the runs produced (never planning itself): the
plan report (:mod:`.plan_report`: plan.md, heat map and throughput figures of a plan
:mod:`simtree.planning.bundles` made), the closed-loop report of a machine's profile -> fit ->
plan -> run, predicted against measured (:mod:`.loop`), and the README's headline table of the
shipped reports (:mod:`.summary`).  Nothing is re-exported: these modules import pandas and,
to draw, matplotlib.
"""
