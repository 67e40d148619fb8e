from nodes.cli import main

raise SystemExit(main())
