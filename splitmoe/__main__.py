from splitmoe.cli import main

raise SystemExit(main())
