"""simtree.profiler"""
