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
	if err := add(rw, landlock.RWDirs, landlock.RWFiles); err != nil {
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
