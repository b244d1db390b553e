"""`python -m nfabric_cli` runs the command-line app (also under torchrun)."""

from nfabric_cli.app import main

if __name__ == "__main__":
    main()
