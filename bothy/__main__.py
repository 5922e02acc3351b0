from bothy.cli import main

raise SystemExit(main())
