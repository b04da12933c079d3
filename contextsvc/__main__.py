from contextsvc._launch import main

raise SystemExit(main())
