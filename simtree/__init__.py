"""simtree: profile, model, plan and run tree-structured speculative decoding."""
from simtree.errors import SimtreeError, TreeError
from simtree.trees.tree import DraftTree, TreeBatch

__version__ = "0.1.0"
__all__ = ["DraftTree", "TreeBatch", "SimtreeError", "TreeError", "__version__"]
