"""simtree.kernels"""
