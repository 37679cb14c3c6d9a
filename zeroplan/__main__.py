from zeroplan.cli.main import main

raise SystemExit(main())
