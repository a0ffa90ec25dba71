from simtree.cli import main

main()
