"""simtree.runtime"""
