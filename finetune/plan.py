"""`python -m finetune.plan ...`: the memory planner's command, kept under the name users type (the docs, the
recipes' first lines, the launcher's "FITS (python -m finetune.plan ... for the breakdown)"). The planner is the
package finetune/planner/; this module only runs its command (finetune.launcher.plan.main)."""

import sys

from finetune.launcher.plan import main

if __name__ == "__main__":
    sys.exit(main())
