"""Reports: plan reports (markdown + PNG) and the closed-loop predicted-vs-measured report."""
