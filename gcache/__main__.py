from gcache.cli import main

raise SystemExit(main())
