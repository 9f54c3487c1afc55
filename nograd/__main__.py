from nograd.cli import main

main()
