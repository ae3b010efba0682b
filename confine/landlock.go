package confine

import (
	"errors"
	"fmt"
	"os"

	"github.com/landlock-lsm/go-landlock/landlock"
	llsys "github.com/landlock-lsm/go-landlock/landlock/syscall"
)

// restrictPaths limits the process's file access to ro (read) and rw
// (read, write, create, remove, rename) with Landlock, at ABI 5 or the
// best the kernel has (ABI 5 adds nothing past it that a VMM needs: its
// network rules would restrict the NAT's own connections). A path that
// does not exist is skipped. Without Landlock it returns errUnavailable.
//
// The rw directories get the "refer" right (ABI 2, Linux 5.19), without
// which Landlock refuses every rename or link that moves a file to
// another directory with EXDEV: a guest's mv a/f b/f in a share, git's
// and pip's renames into place. Moving between rw directories gives the
// VMM nothing it lacks (it may already copy and delete in both). On ABI 1
// the right does not exist and such renames stay refused: asking for it
// there would make go-landlock's best effort drop Landlock altogether.
func restrictPaths(ro, rw []string) (string, error) {
	abi, err := landlockABI()
	if err != nil {
		return "", err
	}
	var rules []landlock.Rule
	add := func(paths []string, dirs, files func(...string) landlock.FSRule) error {
		for _, p := range paths {
			fi, err := os.Stat(p)
			if errors.Is(err, os.ErrNotExist) {
				continue
			} else if err != nil {
				return fmt.Errorf("confine: landlock: %w", err)
			}
			if fi.IsDir() {
				rules = append(rules, dirs(p))
			} else {
				rules = append(rules, files(p))
			}
		}
		return nil
	}
	if err := add(ro, landlock.RODirs, landlock.ROFiles); err != nil {
		return "", err
	}
	rwDirs := landlock.RWDirs
	if abi >= 2 {
		rwDirs = func(paths ...string) landlock.FSRule { return landlock.RWDirs(paths...).WithRefer() }
	}
	if err := add(rw, rwDirs, landlock.RWFiles); err != nil {
		return "", err
	}
	if err := landlock.V5.BestEffort().RestrictPaths(rules...); err != nil {
		return "", fmt.Errorf("confine: landlock: %w", err)
	}
	return fmt.Sprintf("ABI %d, %d paths", min(abi, 5), len(rules)), nil
}

// landlockABI is the kernel's Landlock ABI version, or errUnavailable.
func landlockABI() (int, error) {
	v, err := llsys.LandlockGetABIVersion()
	if err != nil || v < 1 {
		return 0, fmt.Errorf("%w (%v)", errUnavailable, err)
	}
	return v, nil
}
