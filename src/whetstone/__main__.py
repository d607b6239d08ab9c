"""`python -m whetstone ...`: the `whetstone` command without its installed script (a checkout
run from `src/`, as on a machine where the package is not installed)."""

from whetstone import main

main()
