from contextsvc.cli import main

raise SystemExit(main())
