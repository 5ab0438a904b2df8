"""`python -m specgate ...` is the `specgate` command."""

from specgate.gateway.operator.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
