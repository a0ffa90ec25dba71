"""simtree.kernels.layers: model layers built from the kernels."""
