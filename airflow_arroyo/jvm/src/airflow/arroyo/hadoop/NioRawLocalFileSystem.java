/*
 * airflow-arroyo: Hadoop's local file system, setting permissions without starting a process.
 *
 * Hadoop's RawLocalFileSystem sets a file's permission (on every create and mkdirs with a permission, which
 * is how Spark writes its offsets, commits and state files) through libhadoop's chmod when that native
 * library is loaded, and otherwise by STARTING A `chmod` PROCESS: with the pip pyspark, which ships no
 * libhadoop, one per checkpoint file (figures: benchmarks/results/hop_breakdown.md). This class sets the
 * same permission bits through java.nio instead: same files, same modes, an IOException naming a missing file
 * (Hadoop's names chmod's exit status). A file with a setuid or setgid bit (chmod keeps a folder's setgid
 * bit, java.nio would clear it) and the sticky bit still go Hadoop's way.
 */
package airflow.arroyo.hadoop;

import java.io.FileNotFoundException;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;

import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsAction;
import org.apache.hadoop.fs.permission.FsPermission;

public class NioRawLocalFileSystem extends RawLocalFileSystem {

  @Override
  public void setPermission(Path p, FsPermission permission) throws IOException {
    java.nio.file.Path path = pathToFile(p).toPath();
    try {
      // chmod with a numeric mode keeps a folder's setgid bit, java.nio clears it: such files, and the sticky
      // bit java.nio cannot set, go Hadoop's way
      if (permission.getStickyBit() || hasSetIdBits(path)) {
        super.setPermission(p, permission);
        return;
      }
      Files.setPosixFilePermissions(path, posix(permission));
    } catch (NoSuchFileException e) {
      throw new FileNotFoundException("File " + p + " does not exist");
    } catch (UnsupportedOperationException e) {  // not a POSIX file system
      super.setPermission(p, permission);
    }
  }

  private static boolean hasSetIdBits(java.nio.file.Path path) throws IOException {
    try {
      return (((Integer) Files.getAttribute(path, "unix:mode")) & 06000) != 0;
    } catch (UnsupportedOperationException | IllegalArgumentException e) {  // no "unix" view: not known
      return true;
    }
  }

  static Set<PosixFilePermission> posix(FsPermission permission) {
    Set<PosixFilePermission> out = EnumSet.noneOf(PosixFilePermission.class);
    add(out, permission.getUserAction(), PosixFilePermission.OWNER_READ, PosixFilePermission.OWNER_WRITE,
        PosixFilePermission.OWNER_EXECUTE);
    add(out, permission.getGroupAction(), PosixFilePermission.GROUP_READ, PosixFilePermission.GROUP_WRITE,
        PosixFilePermission.GROUP_EXECUTE);
    add(out, permission.getOtherAction(), PosixFilePermission.OTHERS_READ, PosixFilePermission.OTHERS_WRITE,
        PosixFilePermission.OTHERS_EXECUTE);
    return out;
  }

  private static void add(Set<PosixFilePermission> out, FsAction action, PosixFilePermission read,
                          PosixFilePermission write, PosixFilePermission execute) {
    if (action.implies(FsAction.READ)) {
      out.add(read);
    }
    if (action.implies(FsAction.WRITE)) {
      out.add(write);
    }
    if (action.implies(FsAction.EXECUTE)) {
      out.add(execute);
    }
  }
}
