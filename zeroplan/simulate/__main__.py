from zeroplan.simulate.cli import main

raise SystemExit(main())
