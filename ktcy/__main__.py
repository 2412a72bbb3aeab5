from ktcy.cli import main

raise SystemExit(main())
